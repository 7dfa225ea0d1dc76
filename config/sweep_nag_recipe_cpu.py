# Which pieces of nag-nanochat's training recipe matter here: 16-layer nag on character-level
# Shakespeare (width 128, 12 x 64 tokens per iteration, 600 iterations), 3 seeds per cell, every cell
# the default nag (the reference's head, floor and undecayed modulators) with one piece changed.
# About 35 minutes on 2 idle CPU cores (measured, torch 2.13.0):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_nag_recipe_cpu.py

sweep_name = "sweep_nag_recipe_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=300", "--eval_iters=20", "--log_interval=100", "--diagnose=True"]
budget = 9.8e12  # 600 iterations of 16-layer nag (2.13e7 training FLOPs per token x 768 tokens)
depths, residuals = [], []  # no grid: the cells are named below
_nag = {"residual": "nag", "n_layer": 16}
runs = [
    ("default", _nag),
    ("head_sqrt_d", {**_nag, "nag_head": "sqrt_d"}),  # logits e^(s + g_dec) W r / sqrt(d): sqrt(d) larger, a learned g_dec
    ("no_floor", {**_nag, "nag_m_floor": 0.0}),  # mixture not clamped before the power beta
    ("gate_decay", {**_nag, "nag_gate_decay": True}),  # weight decay 0.1 on the modulator matrices
    ("gate_lr_0.05", {**_nag, "nag_gate_lr_scale": 0.05}),  # the reference's gate LR / matrix LR
    ("alpha_warmup", {**_nag, "nag_alpha_warmup_tokens": 115200}),  # alpha ramps over the first quarter (150 iters)
]
seeds = [1, 2, 3]
jobs = 2
