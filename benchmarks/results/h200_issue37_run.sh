#!/bin/bash
# device run: gluon tests first (stop on failure), probe, bench prefill, then the whole kernel suite
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLEETLAB_GLUON_PREFILL=1
# BEFORE: a copy of main's fleetlab/attention/triton_kernels.py (the portable kernel), timed side by side
BEFORE=${BEFORE:-before_kernels.py}
python3 -c "import triton, torch; print(triton.__version__, torch.__version__, torch.backends.cudnn.version())"
python3 -c "import xdist" 2>/dev/null && X="-n 16" || X=""
timeout 100 python3 -m pytest -q $X -rf tests/test_triton_kernels.py -k gluon 2>&1 | tail -40 | tee $OUT/gluon_tests.txt
grep -q "FAILED.*plain\|FAILED.*not_planned\|^ERROR" $OUT/gluon_tests.txt && exit 1
timeout 60 python3 benchmarks/results/h200_issue37_probe.py 2>&1 | tee $OUT/probe.txt
# the bench runs the faster loop of the probe (geometric mean over its shapes)
export FLEETLAB_GLUON_OVERLAP=$(python3 -c "
import re,math;r=[(float(a),float(b)) for a,b in re.findall(r'gluon/cudnn ([0-9.]+) overlap/cudnn ([0-9.]+)',open('$OUT/probe.txt').read())]
print(int(bool(r) and sum(math.log(b/a) for a,b in r)>0))")
grep -q "FAILED.*overlap" $OUT/gluon_tests.txt && export FLEETLAB_GLUON_OVERLAP=0
echo FLEETLAB_GLUON_OVERLAP=$FLEETLAB_GLUON_OVERLAP
timeout 120 python3 -m fleetlab.bench.triton_attention --json $OUT/h200_prefill.json --sections prefill --before "$BEFORE" 2>&1 | grep -v "it/s\|s/shape" | tail -40 | tee $OUT/bench.txt
FLEETLAB_TRITON_ERRORS=$OUT/errors.json timeout 90 python3 -m pytest -q $X -rf tests/test_triton_kernels.py -p no:cacheprovider -k "prefill or mixed or empty or masked or step" 2>&1 | tail -15 | tee $OUT/suite.txt
