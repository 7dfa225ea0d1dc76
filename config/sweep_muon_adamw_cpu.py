# The AdamW side of config/sweep_muon_cpu.py that no earlier sweep ran: its six designs at 8 layers and
# 1.25e12 training FLOPs, the recipe of config/sweep_shakespeare_cpu.py (AdamW, LR 1e-3), 3 seeds. (4 layers
# at 1.25e12 and 5e12: config/sweep_multiplier_cpu.py's runs; 8 layers at 5e12: sweep_shakespeare_cpu,
# sweep_shakespeare_mhc_cpu and sweep_shakespeare_next_cpu's.) 18 runs, two at a time, about 12 minutes:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_muon_adamw_cpu.py

sweep_name = "sweep_muon_adamw_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 1.25e12
depths, residuals = [], []  # no grid: the cells are named below
runs = [(f"{name}_L8", {**options, "n_layer": 8}) for name, options in [
    ("prenorm", {"residual": "prenorm"}),
    ("nag", {"residual": "nag"}),
    ("block_attnres", {"residual": "block_attnres"}),
    ("value_residual", {"residual": "prenorm", "value_residual": "half"}),
    ("mudd", {"residual": "mudd"}),
    ("mhc", {"residual": "mhc"}),
]]
seeds = [1, 2, 3]
jobs = 2
