#!/usr/bin/env bash
# Issue 23: Nsight Compute on the Gluon W4A16 kernel (research/ncu_wgmma.py), the report and its per-instruction
# source page under $OUT. One device call of ~3 min:  bash research/gpu_ncu_wgmma.sh
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
which ncu || ls /usr/local/cuda*/bin/ncu
timeout 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section SourceCounters --section LaunchStats -o $OUT/ncu_wgmma python3 research/ncu_wgmma.py > $OUT/ncu_log.txt 2>&1; echo "ncu rc=$?"; tail -3 $OUT/ncu_log.txt
timeout 60 ncu -i $OUT/ncu_wgmma.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
timeout 60 ncu -i $OUT/ncu_wgmma.ncu-rep --page source --csv --print-source sass > $OUT/ncu_source.csv 2>&1
ls -la $OUT; grep -E "Duration|Warp Cycles Per Issued|Issued Warp Per Scheduler|Achieved Occupancy|Registers Per|Stall|w4a16_wgmma|gemm|Compute \(SM\) Throughput|Memory Throughput" $OUT/ncu_details.txt | head -60
