set -x
export PYTHONPATH=.
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 250 python -m pytest -q -x tests/engine/spec tests/engine/experts tests/engine/test_graphs.py tests/engine/test_runtime.py -p no:cacheprovider > $OUT/r/gpu-tests.log 2>&1; tail -3 $OUT/r/gpu-tests.log
python bench/paired.py --stem paired-spmoe-olmoe-50 --out $OUT/r --note "tree: main at $TREE" --table default-olmoe --budget 50% --spec-tokens 8 --arm "plain SD" --arm "SP-MoE" --arm "SP-MoE@spec_cutoff=6" --prompts 8 --tokens 128 --rounds 4 --deadline-s 80 > $OUT/r/p50.log 2>&1; tail -8 $OUT/r/p50.log
grep -i "cutoff" $OUT/r/p50.log | head -5
tar czf $OUT/results.tgz -C $OUT r
