# Iso-FLOP Mixture-of-Depths on character-level Shakespeare (width 128, 12 x 64 tokens per iteration):
# every run trains on the FLOPs of 1000 iterations of the dense 8-layer nag, so a MoD run, cheaper per
# token, trains on more tokens (top-k training runs exactly its capacity: the FLOP count is realised).
# nag: dense, mod=nag at 0.125 and 0.25, and a dense 6-layer nag (about the FLOPs per token of 8 layers
# at 0.25); prenorm: dense and mod=router at the same rates. 3 seeds, 21 runs, 37 minutes on 2 cores (measured):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_mod_cpu.py

sweep_name = "sweep_mod_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 8.19e12  # 1000 iterations of dense 8-layer nag: 1.0667e7 training FLOPs/token x 768 tokens
depths, residuals = [], []  # the cells are named below
runs = [  # run seed by seed, each seed in this order
    ("nag_L8", {"residual": "nag", "n_layer": 8}),
    ("nag_L8_mod0.25", {"residual": "nag", "n_layer": 8, "mod": "nag", "mod_rate": 0.25}),
    ("nag_L8_mod0.125", {"residual": "nag", "n_layer": 8, "mod": "nag", "mod_rate": 0.125}),
    ("nag_L6", {"residual": "nag", "n_layer": 6}),
    ("prenorm_L8", {"residual": "prenorm", "n_layer": 8}),
    ("prenorm_L8_router0.25", {"residual": "prenorm", "n_layer": 8, "mod": "router", "mod_rate": 0.25}),
    ("prenorm_L8_router0.125", {"residual": "prenorm", "n_layer": 8, "mod": "router", "mod_rate": 0.125}),
]
seeds = [1, 2, 3]
jobs = 2
