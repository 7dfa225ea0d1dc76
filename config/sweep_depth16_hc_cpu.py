# hc and mhc in the 16-layer depth experiment (docs/experiments.md, "The stream against depth"): the
# settings of config/sweep_depth16_cpu.py (the quickstart recipe at 1000 iterations, equal iterations
# and tokens for every mode, with diagnostics), 3 seeds. Read beside the five other modes with
# python flops.py results results/sweep_depth16_cpu.csv results/sweep_depth16_hc_cpu.csv
# 6 runs, two at a time; hc costs 1.5x prenorm's step on this CPU, mhc 2.7x (bench.py, fp32): 2 hours
# on 2 cores with other work on the machine (docs/experiments.md, "Hyper-connections"):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_depth16_hc_cpu.py

sweep_name = "sweep_depth16_hc_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--max_iters=1000", "--lr_decay_iters=1000", "--eval_interval=500", "--eval_iters=20",
              "--log_interval=250", "--diagnose=True"]
budget = None  # max_iters decides
depths = [16]
residuals = ["mhc", "hc"]
seeds = [1, 2, 3]
jobs = 2
