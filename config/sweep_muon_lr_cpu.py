# Muon's LR for the optimizer comparison (config/sweep_muon_cpu.py): prenorm alone, 4 layers, width 128,
# 5e12 training FLOPs, one seed, three Muon LRs around nanochat's 0.02 (x 2.5 apart); AdamW's LR for the
# embedding, head, norms and gains stays the recipe's 1e-3. The best of the three is the LR every design
# gets in the comparison: no design gets an LR the baseline did not get. 3 runs, two at a time, about
# 7 minutes on 2 idle cores:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_muon_lr_cpu.py

sweep_name = "sweep_muon_lr_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12
depths, residuals = [], []  # no grid: the cells are named below
runs = [(f"prenorm_muon_lr{lr:g}", {"residual": "prenorm", "n_layer": 4, "optimizer": "muon", "muon_lr": lr})
        for lr in (0.008, 0.02, 0.05)]
seeds = [1]
jobs = 2
