# Interleaved 1F1B: Megatron-LM's schedule over v model chunks per device.
# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC 2021), §2.2.2 and Figure 4 (bottom), with Megatron's
# microbatch groups (`microbatch_group_size_per_vp_stage`, g, by default d): a
# device runs a group of g microbatches through a chunk before the next chunk.
# Device i warms up with 2(d-1-i) + (v-1)g forwards, then one forward and one
# backward in turn; backwards visit the chunks in reverse. As a grouped block:
# a device's passes of one group are 3 apart (T_F + T_BW), forward k of the group
# (chunk c, microbatch r) at 3k + i, k = g c + r, and backward k right after
# forward k + warm-up; a group every 3 v g. The order is Megatron's pass for pass
# (tests/test_interleaved.py compares it with a generator of Megatron's rule).
# Works for every d >= 1, v >= 1, g >= d and m a multiple of g (Megatron's constraints).
schedule interleaved_1f1b {
    param d = 4
    param v = 2
    param m = 2 * d
    param g = d
    require g >= d and m % g == 0, "Megatron's interleaved order needs g >= d and m a multiple of g"
    place looped(v)
    backward fused
    block period 3 * v * g group g every 3 {
        F at i + 3 * g * c
        BW at i + 1 + 3 * (2 * (d - 1 - i) + (v - 1) * g) + 3 * g * (v - 1 - c)
    }
    # §2.2.2: the bubble is 1/v of 1F1B's on the same model; with the costs of one
    # chunk (1/v of a stage) that is (p-1)(T_F + T_BW) per device
    expect bubble == (d - 1) * (T_F + T_BW) / (m * v * (T_F + T_BW) + (d - 1) * (T_F + T_BW))
    # device 0 holds its warm-up forwards and one more (chunk activations)
    expect peak_memory <= min(2 * (d - 1) + (v - 1) * g + 1, m * v) * M_B
    expect peak_memory[0] == min(2 * (d - 1) + (v - 1) * g + 1, m * v) * M_B
}
