# Interleaved 1F1B: Megatron-LM's schedule over v model chunks per device.
# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC 2021), §2.2.2 and Figure 4 (bottom): looped placement;
# device i warms up with 2(d-1-i) + (v-1)d forwards, then one forward and one
# backward in turn. The k-th forward of a device is microbatch
# (k // (d v)) d + k % d of chunk (k // d) % v; backwards visit the chunks in reverse.
# Works for every d >= 1, v >= 1 and m a multiple of d (Megatron's constraint).
schedule interleaved_1f1b {
    param d = 4
    param v = 2
    param m = 2 * d
    require m % d == 0, "Megatron's interleaved order needs m to be a multiple of d"
    place looped(v)
    backward fused
    order {
        let total = m * v
        let warm = min(2 * (d - 1 - i) + (v - 1) * d, total)
        for k in 0..warm { F(k // (d * v) * d + k % d, k // d % v) }
        interleave {
            for k in warm..total { F(k // (d * v) * d + k % d, k // d % v) }
        } with {
            for k in 0..total { BW(k // (d * v) * d + k % d, v - 1 - k // d % v) }
        }
    }
    # §2.2.2: the bubble is 1/v of 1F1B's on the same model; with the costs of one
    # chunk (1/v of a stage) that is (p-1)(T_F + T_BW) per device
    expect bubble == (d - 1) * (T_F + T_BW) / (m * v * (T_F + T_BW) + (d - 1) * (T_F + T_BW))
    # device 0 holds its warm-up forwards and one more (chunk activations)
    expect peak_memory <= min(2 * (d - 1) + (v - 1) * d + 1, m * v) * M_B
    expect peak_memory[0] == min(2 * (d - 1) + (v - 1) * d + 1, m * v) * M_B
}
