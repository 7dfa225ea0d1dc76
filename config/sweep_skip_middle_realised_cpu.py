# skip_middle given the iterations its realised FLOPs buy (the caveat of config/sweep_skip_middle_cpu.py):
# there its iterations come from its dense count, and its three seeds spend 81.4% of the budget (mean of
# 6.87, 5.79, 6.61e12). This cell is given that budget / 0.814 counted dense (9.69e12: 1228 iterations),
# which it spends as about the 7.89e12 of the other cells. Compared with them through
# python flops.py results results/sweep_skip_middle_cpu.csv results/sweep_skip_middle_realised_cpu.csv --baseline=sandwich_L6
# 3 seeds, 3 runs, two at a time on 2 cores: about 8 minutes a run (measured):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_skip_middle_realised_cpu.py

sweep_name = "sweep_skip_middle_realised_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=250", "--eval_iters=20", "--log_interval=250"]
budget = 9.69e12  # 7.89e12 / 0.814, counted dense: the iterations that spend about 7.89e12 at 81.4% executed
depths, residuals = [], []
runs = [
    ("sandwich_L8_skip_middle0.25_realised", {"residual": "sandwich", "n_layer": 8, "mod": "skip_middle",
                                               "mod_rate": 0.25}),
]
seeds = [1, 2, 3]
jobs = 2
