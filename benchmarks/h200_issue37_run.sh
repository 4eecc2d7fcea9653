#!/bin/bash
# Issue #37's H200 run (and #34 item 5's): device `run` with carry=["gpu_stage"], gpu_stage/ holding
# before_kernels.py (git show 3d58b26:fleetlab/attention/triton_kernels.py) and one_prefill.py.
# 1. the kernel suite (the warp-specialised Gluon prefill is the plan's default on sm_90), its errors;
# 2. the whole Triton bench with issue #37's layouts and #34's plan overlap, against the 3d58b26 kernels;
# 3. Nsight Compute on one 1 x 8k prefill; 4. the plan-overlap probe of issue #34.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import triton, torch; print(triton.__version__, torch.__version__, torch.backends.cudnn.version())"
FLEETLAB_TRITON_ERRORS=$OUT/errors.json timeout 170 python3 -m pytest -q -n 16 -p no:cacheprovider --timeout 120 \
    -rf tests/test_triton_kernels.py > $OUT/suite.txt 2>&1
tail -4 $OUT/suite.txt
timeout 320 python3 -m fleetlab.lab.bench.triton_attention --json $OUT/h200_triton.json --errors $OUT/errors.json \
    --before gpu_stage/before_kernels.py --sections decode,shapes,issue,multi,prefill,step,layouts,overlap \
    > $OUT/bench.txt 2>&1
grep -v "it/s\|s/shape" $OUT/bench.txt | tail -60
timeout 45 ncu --clock-control none -k regex:_gluon_ws --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
    python3 gpu_stage/one_prefill.py > $OUT/ncu.txt 2>&1
tail -60 $OUT/ncu.txt
timeout 40 python3 benchmarks/h200_overlap_plan_probe.py --out $OUT/overlap_probe.json 2>&1 | tail -5
grep -E "^FAILED|passed|failed" $OUT/suite.txt | tail -12
# what comes back is at most 8 files: the suite's per-worker error files alone are 16, so one archive
cd $OUT && tar czf h200_run.tgz --remove-files -- *
