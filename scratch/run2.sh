set -x
export PYTHONPATH=.
mkdir -p $OUT/r
timeout 200 python -m pytest -q -x tests/engine/spec tests/engine/test_graphs.py -p no:cacheprovider > $OUT/r/gpu-tests.log 2>&1; tail -2 $OUT/r/gpu-tests.log
for b in 50 75 25; do
python bench/paired.py --stem paired-spmoe-olmoe-$b --out $OUT/r --note "tree: main at $TREE" --table default-olmoe --budget $b% --spec-tokens 8 --arm "plain SD" --arm "SP-MoE" --arm "SP-MoE@spec_cutoff=6" --prompts 8 --tokens 128 --rounds 4 --deadline-s 80 > $OUT/r/p$b.log 2>&1; grep -E "^\| |automatic|vs " $OUT/r/p$b.log | tail -7
done
python bench/paired.py --stem paired-adaptive-gamma-olmoe-50 --out $OUT/r --note "tree: main at $TREE" --table default-olmoe --budget 50% --spec-tokens 8 --arm "plain SD" --arm "plain SD@spec_adaptive_tokens=true" --arm "plain SD@spec_tokens=12" --arm "plain SD@spec_tokens=12,spec_adaptive_tokens=true" --prompts 8 --tokens 128 --rounds 4 --deadline-s 100 > $OUT/r/pg.log 2>&1; grep -E "^\| |vs " $OUT/r/pg.log | tail -8
tar czf $OUT/results.tgz -C $OUT r
