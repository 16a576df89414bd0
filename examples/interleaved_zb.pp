# Interleaved zero bubble: interleaved 1F1B with the backward split into B and W.
# The grouped building block of the zero-bubble repository (Qi et al., "Zero Bubble
# Pipeline Parallelism", ICLR 2024; sail-sg/zero-bubble-pipeline-parallelism,
# scheduler/group_interleaved_1f1b.py, without recomputation): looped placement,
# microbatches in groups of g through each chunk as in Megatron's interleaved 1F1B,
# a device's passes of a group 3 apart (T_F + T_B + T_W at unit costs): forward k
# of the group (chunk c, microbatch r, k = g c + r) at 3k + i; device i's first B
# once the last stage's has come back, g(v-1) + d-1-i forwards later; W right
# after its B. A group every 3 v g: the steady state has no bubble.
# Works for every d >= 1, v >= 1, g >= d and m a multiple of g.
schedule interleaved_zb {
    param d = 4
    param v = 2
    param m = 2 * d
    param g = d
    place looped(v)
    backward split
    block period 3 * v * g group g every 3 {
        F at i + 3 * g * c
        B at i + 1 + 3 * (g * (v - 1) + d - 1 - i) + 3 * g * (v - 1 - c)
        W at i + 2 + 3 * (g * (v - 1) + d - 1 - i) + 3 * g * (v - 1 - c)
    }
    # per device, (d-1)(T_F + T_B) of bubble: interleaved 1F1B's (d-1)(T_F + T_BW)
    # less (d-1) T_W (at unit costs or any costs up to the slots' one unit)
    expect bubble == (d - 1) * (T_F + T_B) / (m * v * (T_F + T_B + T_W) + (d - 1) * (T_F + T_B))
    # device i holds g(v-1) + d - i chunk activations before its first B: d - 1
    # fewer than interleaved 1F1B's 2(d-1) + (v-1)g + 1 on device 0
    expect peak_memory <= ((v - 1) * g + d) * M_B
    expect peak_memory[d - 1] == ((v - 1) * g + 1) * M_B
}
