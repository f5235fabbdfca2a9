set -x
export PYTHONPATH=.
mkdir -p $OUT/r
timeout 200 python -m pytest -q -x tests/engine/spec tests/engine/experts tests/engine/test_graphs.py tests/engine/test_runtime.py -p no:cacheprovider > $OUT/r/gpu-tests.log 2>&1; tail -2 $OUT/r/gpu-tests.log
for b in 50 75; do
python bench/paired.py --stem paired-spmoe-olmoe-$b --out $OUT/r --note "tree: main at 39c1bbf" --table default-olmoe --budget $b% --spec-tokens 8 --arm "plain SD" --arm "SP-MoE" --prompts 8 --tokens 128 --rounds 6 --deadline-s 90 > $OUT/r/p$b.log 2>&1; grep -E "^\| |automatic|vs " $OUT/r/p$b.log | tail -5
done
python scratch/prof.py 50% $OUT/r/prof50.json > /dev/null 2>&1
python -c "
import json; d=json.load(open('$OUT/r/prof50.json'))
for n,v in d.items():
    print(n, 'wall', round(v['wall_ms_per_tok'],3), {k:(round(x['ms_total_per_tok'],3), round(x['us_per_call'])) for k,x in v.items() if isinstance(x,dict)})
"
tar czf $OUT/results.tgz -C $OUT r
