# The AdamW side of the Muon comparison at 8 layers and 5e12 FLOPs rerun at AdamW's best learning rate there:
# config/sweep_lr_check_cpu.py found 2e-3 the best of 5e-4, 1e-3, 2e-3 and 4e-3 (1 seed each, seed 11) for every
# model but mudd (4e-3, 0.0055 lower than 2e-3), not the recipe's 1e-3, on which the comparison's AdamW cells ran
# (docs/experiments.md, "Muon against AdamW"); one LR for all, as the recipe's was. The same six models,
# recipe and seeds (1 to 3) as those cells, --learning_rate=0.002. 18 runs, two at a time, about 20 minutes:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_muon_adamw_best_lr_cpu.py
# python flops.py optimizers results/sweep_muon_cpu_5e12.csv results/sweep_muon_adamw_best_lr_cpu.csv --adamw_lr=0.002

sweep_name = "sweep_muon_adamw_best_lr_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 5e12
depths, residuals = [], []  # no grid: the cells are named below
_models = dict(prenorm={"residual": "prenorm"}, nag={"residual": "nag"}, block_attnres={"residual": "block_attnres"},
               value_residual={"residual": "prenorm", "value_residual": "half"}, mudd={"residual": "mudd"},
               mhc={"residual": "mhc"})  # (private: a leading _) sweep_muon_adamw_cpu.py's six
runs = [(f"{name}_L8_adamw_lr0.002", {**keys, "n_layer": 8, "learning_rate": 2e-3}) for name, keys in _models.items()]
seeds = [1, 2, 3]
jobs = 2
