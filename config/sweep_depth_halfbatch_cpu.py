# Depth apart from training length (docs/experiments.md, "How much compute each design is worth, by depth"): at
# 2.5e12 FLOPs a 16-layer run of the depth grid (config/sweep_depth_multiplier_cpu.py) trains 159 steps with a
# 16-step warm-up, too few for a headline figure (flops.py multiplier leaves out cells under 300 steps). Here the
# same two cells train at half the batch (6 sequences of 64 tokens), so twice the steps (318, warm-up 32) at the same
# FLOPs, same LR and schedule rule, same 5 seeds: does nag's gain over prenorm at 16 layers survive?
#
# 2 cells x 5 seeds = 10 runs, about 0.1 hours on 2 cores (flops.py plan ... --like=results/sweep_depth_multiplier_cpu.csv;
# a half batch's steps cost more per FLOP than it says), two at a time (resumable):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_depth_halfbatch_cpu.py
# python flops.py results results/sweep_depth_halfbatch_cpu.csv   # nag against prenorm, paired over the seeds

sweep_name = "sweep_depth_halfbatch_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=50", "--batch_size=6"]
budget = 2.5e12
depths, residuals = [], []  # no grid: the cells are named below
runs = [("prenorm_L16_half_batch", {"residual": "prenorm", "n_layer": 16}),
        ("nag_L16_half_batch", {"residual": "nag", "n_layer": 16})]
seeds = [1, 2, 3, 4, 5]
jobs = 2
