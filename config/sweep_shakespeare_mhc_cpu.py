# mhc in the iso-FLOP depth sweep of config/sweep_shakespeare_cpu.py (width 128, 2/4/8 layers, 5e12
# training FLOPs per run, mhc's extra FLOPs counted, so it trains fewer iterations), 3 seeds. Read
# beside prenorm, nag and block_attnres with
# python flops.py results results/sweep_shakespeare_cpu.csv results/sweep_shakespeare_mhc_cpu.csv
# 9 runs, two at a time: about 35 minutes on 2 idle cores (7 to 8 minutes a run):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_shakespeare_mhc_cpu.py

sweep_name = "sweep_shakespeare_mhc_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12
depths = [2, 4, 8]
residuals = ["mhc"]
mod_runs = []
seeds = [1, 2, 3]
jobs = 2
