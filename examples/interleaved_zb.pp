# Interleaved zero bubble: interleaved 1F1B with the backward split into B and W,
# each W delayed as in ZB-H1. Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR
# 2024), §3.1 (ZB-H1's W placement) on Megatron's interleaved order with microbatch
# groups of g; torch.distributed.pipelining ships it as ScheduleInterleavedZeroBubble
# (tests/test_interleaved.py: pass for pass the same order). The grouped building
# block of the zero-bubble repository (scheduler/group_interleaved_1f1b.py) has the
# same F and B slots. A device's passes of a group are 3 apart (T_F + T_B + T_W at
# unit costs): forward k of the group (chunk c, microbatch r, k = g c + r) at 3k + i;
# device i's first B once the last stage's has come back, g(v-1) + d-1-i forwards
# later; a W i slots after its B (more M_W held on later devices, as in ZB-H1). A
# group every 3 v g: the steady state has no bubble.
# Works for every d >= 1, v >= 1, g >= d and m a multiple of g.
schedule interleaved_zb {
    param d = 4
    param v = 2
    param m = 2 * d
    param g = d
    require g >= d and m % g == 0, "the interleaved order needs g >= d and m a multiple of g"
    place looped(v)
    backward split
    block period 3 * v * g group g every 3 {
        F at i + 3 * g * c
        B at i + 1 + 3 * (g * (v - 1) + d - 1 - i) + 3 * g * (v - 1 - c)
        W at i + 2 + 3 * (g * (v - 1) + d - 1) + 3 * g * (v - 1 - c)
    }
    # ZB-H1's bubble, (d-1)(T_F + T_B - T_W) per device, at these unit costs: d - 1,
    # interleaved 1F1B's (d-1)(T_F + T_BW) less 2(d-1)
    expect bubble == (d - 1) / (3 * m * v + d - 1)
    # ZB-H1's memory on worker i plus the (v-1)g forwards of the earlier chunks:
    # (g(v-1) + d - i) M_B + i M_W, most on device 0 (d - 1 fewer chunk activations
    # than interleaved 1F1B's)
    expect peak_memory <= ((v - 1) * g + d) * M_B
    expect peak_memory[0] == ((v - 1) * g + d) * M_B
    expect peak_memory[d - 1] == ((v - 1) * g + 1) * M_B + (d - 1) * M_W
}
