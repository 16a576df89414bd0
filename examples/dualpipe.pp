# DualPipe: DeepSeek's bidirectional pipeline.
# DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437, 2024), §3.2.1 and
# Figure 5: 8 ranks, 20 microbatches, the order of deepseek-ai/DualPipe's eight steps.
# `place dualpipe` runs two pipelines of d stages: microbatches 0..m/2-1 go down the
# devices (stage s on device s), microbatches m/2..m-1 go up (stage d+k, a copy of
# model stage k, on device d-1-k); every device holds a stage of each direction, so
# the parameters are held twice and the two copies' gradients are summed.
# Device i's "phase 0" is the direction whose stage it holds nearer that direction's
# start (down on the first half of the devices, up on the second), as in DualPipe.
# A full backward there is B then W here; an overlapped F&B (`F(..) & B(..)`) is one
# pass lasting `overlap` x (F + B), then its W.
# Works for every d that is even and every even m >= 2d (DualPipe's own constraints).
schedule dualpipe {
    param d = 8
    param m = 2 * d + 4               # the figure's 20 microbatches at d = 8
    require d % 2 == 0 and m % 2 == 0 and m >= 2*d, "DualPipe needs an even d and an even m >= 2d"
    place dualpipe                    # chunk 0 = stage i (down), chunk 1 = stage 2d-1-i (up)
    backward split
    cost overlap = 3/4                # an overlapped F&B takes 3/4 of F + B (an assumption)
    memory M_W = M_B                  # activations count until W ends, as DualPipe's table
    # DualPipe's table (deepseek-ai/DualPipe README, PP = d): activation PP + 1 per
    # device; bubble (PP/2 - 1)(F&B + B - 3W), B its full backward (our B + W) and F&B
    # a forward overlapped with a full backward (our overlapped pair, then its W)
    let pairs = m - 2*d + 1 + d // 2 - (d == 2 ? 1 : 0)   # overlapped pairs on device 0 (the fewest)
    let busy = m * (T_F + T_B + T_W) - pairs * (1 - T_overlap) * (T_F + T_B)
    let fb = T_overlap * (T_F + T_B) + T_W
    expect peak_memory <= (d + 1) * M_B
    expect makespan <= busy + (d / 2 - 1) * (fb + (T_B + T_W) - 3 * T_W)
    order {
        let n = d // 2                # DualPipe's half of the ranks
        let h = min(i, d - 1 - i)     # this device's distance from the nearer end
        let half_m = m // 2           # microbatches per direction
        let c0 = i < n ? 0 : 1        # phase 0's chunk and its first microbatch
        let o0 = c0 * half_m
        let c1 = 1 - c0               # phase 1's chunk and its first microbatch
        let o1 = c1 * half_m
        let half = (h + 1) // 2       # step 6 defers W from here on
        # 1: phase-0 forwards
        for k in 0..2*(n - h - 1) { F(o0 + k, c0) }
        # 2: both phases' forwards
        for k in 0..h + 1 { F(o0 + 2*(n - h - 1) + k, c0); F(o1 + k, c1) }
        # 3: zero-bubble B/W of phase 1, and its next forward
        for k in 0..n - h - 1 { B(o1 + k, c1); W(o1 + k, c1); F(o1 + h + 1 + k, c1) }
        # 4: the main step, F0 overlapped with B1, then F1 with B0 (the middle devices
        # run their first pair one after the other, to shorten the bubble)
        for k in 0..half_m - d + h + 1 {
            if k == 0 and h == n - 1 {
                F(o0 + 2*n - h - 1, c0); B(o1 + n - h - 1, c1)
            } else {
                F(o0 + 2*n - h - 1 + k, c0) & B(o1 + n - h - 1 + k, c1)
            }
            W(o1 + n - h - 1 + k, c1)
            F(o1 + n + k, c1) & B(o0 + k, c0); W(o0 + k, c0)
        }
        # 5: B1, then F1 with B0
        for k in 0..n - h - 1 {
            B(o1 + half_m - n + k, c1); W(o1 + half_m - n + k, c1)
            F(o1 + half_m - n + h + 1 + k, c1) & B(o0 + half_m - 2*n + h + 1 + k, c0)
            W(o0 + half_m - 2*n + h + 1 + k, c0)
        }
        # 6: B1 B0; the second half defers its W
        for k in 0..h + 1 {
            B(o1 + half_m - h - 1 + k, c1)
            if k < half or (k == half and h % 2 == 0) { W(o1 + half_m - h - 1 + k, c1) }
            B(o0 + half_m - n + k, c0)
            if k < half { W(o0 + half_m - n + k, c0) }
        }
        # 7, 8: the deferred W, oldest first, with step 7's B0 between them
        for t in 0..n {
            if t < h + 1 {
                let e = t + 1 - h % 2
                let u = half + e // 2
                if e % 2 == 0 { W(o1 + half_m - h - 1 + u, c1) } else { W(o0 + half_m - n + u, c0) }
            } else {
                W(o0 + half_m - n + t, c0)
            }
            if t < n - h - 1 { B(o0 + half_m - n + h + 1 + t, c0) }
        }
    }
}
