# The quickstart: a small character-level Shakespeare model that trains on a laptop CPU in about
# 3 minutes on 2 idle cores (nanoGPT's CPU recipe). python train.py config/shakespeare_char_cpu.py

out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 100
always_save_checkpoint = True

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = "auto"  # the GPU if there is one, else the CPU
compile = False
