# 1F1B with full recomputation (activation checkpointing): every stage's F keeps
# only its input, and R runs the stage's forward again just before its backward.
# Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys 2023) trains with it;
# Megatron's `--recompute-granularity full` and torchtitan's
# `activation_checkpoint.mode = "full"` do the same per layer.
# The building block: 1F1B's (F of stage s at s) with R in the slot before the fused
# backward; the period grows by T_R, so that F, R and BW of a device never collide:
# F at s, R at 4d-3-3s, BW at 4d-2-3s, period T_F + T_R + T_BW = 4.
# Works for every d >= 1 and m >= d (required below: with fewer microbatches
# device 0 holds fewer inputs than the exact bound says).
schedule one_f_one_b_recompute {
    param d = 4
    param m = 2 * d
    require m >= d, "1F1B's d - 1 kept inputs on device 0 need m >= d microbatches"
    place parallel
    backward fused
    recompute                          # every stage
    # a stage's input beside its activations: s·b·h against s·b·(34h + 5a·s) per
    # transformer layer (zero-bubble paper §2), under 1/34; 1/16 keeps the numbers short
    memory M_I = M_B / 16
    block period 4 {
        F at s
        R at 4*d - 3 - 3*s
        BW at 4*d - 2 - 3*s
    }
    # controllable-memory paper: stage s lives 4(d - s) but holds its whole
    # activation only from R to the end of BW, 3 < T: one microbatch's M_B (the
    # input of the one recomputed among it), plus the inputs of the d - 1 - s
    # microbatches between their F and R (1F1B holds d - s whole ones)
    expect lifespan[0] == 4 * d
    expect peak_memory <= M_B + (d - 1) * M_I
    expect peak_memory[0] == M_B + (d - 1) * M_I
    expect peak_memory[d - 1] == M_B
    # T_F + T_R + T_BW per microbatch; the warm-up and cool-down bubble stays 1F1B's
    # (d-1)(T_F + T_BW): the last stage recomputes right after its F
    let busy = m * (T_F + T_R + T_BW)
    let idle = (d - 1) * (T_F + T_BW)
    expect makespan == busy + idle
    expect bubble == idle / (busy + idle)
}
