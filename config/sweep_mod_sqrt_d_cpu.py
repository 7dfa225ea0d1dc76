# Does the head explain why mod=nag loses to dense nag at equal training FLOPs (docs/experiments.md, "MoD
# against dense at equal training FLOPs")? With the default head (nag_head=cosine) the logits' scale is
# e^s, and a token that skips a sublayer keeps a lower s; the sqrt_d head adds a learned g_dec. The nag
# cells of config/sweep_mod_cpu.py, at the same budget, with --nag_head=sqrt_d. 3 seeds, 6 runs:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_mod_sqrt_d_cpu.py

sweep_name = "sweep_mod_sqrt_d_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250", "--nag_head=sqrt_d"]
budget = 8.19e12  # as config/sweep_mod_cpu.py: 1000 iterations of the dense 8-layer nag (default head)
depths, residuals = [], []
runs = [
    ("nag_sqrt_d_L8", {"residual": "nag", "n_layer": 8}),
    ("nag_sqrt_d_L8_mod0.25", {"residual": "nag", "n_layer": 8, "mod": "nag", "mod_rate": 0.25}),
]
seeds = [1, 2, 3]
jobs = 2
