# DualPipeV: DeepSeek's DualPipe cut in half, on a V-shape placement.
# DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437, 2024), §3.2.1 and
# Figure 5 (DualPipe); the V variant of deepseek-ai/DualPipe, in the order of
# torch.distributed.pipelining's ScheduleDualPipeV (torch 2.x), its eight steps below.
# A full backward there is B then W here; an overlapped "F and B" pair (torch's
# OVERLAP_F_B) is `F(..) & B(..)`: one pass, started once both inputs are in, lasting
# `overlap` x (F + B), then the pair's W.
# Works for every d >= 1 and m >= 2d (torch's constraint: at least as many microbatches
# as stages).
schedule dualpipe_v {
    param d = 4
    param m = 2 * d
    require m >= 2*d, "DualPipeV needs m >= 2d microbatches"
    place vshape                      # chunk 0 = stage i, chunk 1 = stage 2d-1-i
    backward split
    memory M_W = M_B                  # activations count until W ends, as in V-Min/V-Half
    # DualPipe's table (deepseek-ai/DualPipe README): DualPipeV holds PP + 1 chunk
    # activations per device, PP = 2d its stages
    expect peak_memory <= (2*d + 1) * M_B
    order {
        let main = m - 2*d + i + 1    # step 4's length
        let half = (i + 1) // 2       # step 6 defers W from here on
        # 1: chunk-0 forwards
        for k in 0..2*(d - 1 - i) { F(k, 0) }
        # 2: both chunks' forwards
        for k in 0..i + 1 { F(2*(d - 1 - i) + k, 0); F(k, 1) }
        # 3: zero-bubble B/W of chunk 1, and its next forward
        for k in 0..d - 1 - i { B(k, 1); W(k, 1); F(i + 1 + k, 1) }
        # 4: the main step, F0 overlapped with B1, then F1 with B0 (the last device runs
        # its first pair one after the other, to shorten the bubble)
        for k in 0..main {
            if k == 0 and i == d - 1 {
                F(2*d - 1 - i, 0); B(d - 1 - i, 1)
            } else {
                F(2*d - 1 - i + k, 0) & B(d - 1 - i + k, 1)
            }
            W(d - 1 - i + k, 1)
            F(d + k, 1) & B(k, 0); W(k, 0)
        }
        # 5: B1, then F1 overlapped with B0
        for k in 0..d - 1 - i {
            B(m - d + k, 1); W(m - d + k, 1)
            F(m - d + i + 1 + k, 1) & B(main + k, 0); W(main + k, 0)
        }
        # 6: B1 B0; the second half defers its W
        for k in 0..i + 1 {
            B(m - i - 1 + k, 1)
            if k < half or (k == half and i % 2 == 0) { W(m - i - 1 + k, 1) }
            B(m - d + k, 0)
            if k < half { W(m - d + k, 0) }
        }
        # 7, 8: the deferred W, oldest first, with the last B0 of step 7 between them
        for k in 0..d {
            if k < i + 1 {
                let e = k + 1 - i % 2
                let t = half + e // 2
                if e % 2 == 0 { W(m - i - 1 + t, 1) } else { W(m - d + t, 0) }
            } else {
                W(m - d + k, 0)
            }
            if k < d - 1 - i { B(m - d + i + 1 + k, 0) }
        }
    }
}
