# DualPipe's two lanes with recomputation on each lane's first stage (stages 0
# and 2 at d = 2): microbatches 0, 1 go down (stages 0, 1), 2, 3 up (stages 2, 3);
# an R runs just before the backward of a recomputed stage only. The dist tests
# check its step against the single-process run and its measured memory.
schedule dualpipe_recompute {
    param d = 2
    param m = 4
    require d == 2 and m == 4, "this order is written for d = 2 and m = 4"
    place dualpipe
    backward fused
    recompute[s] = s % 2 == 0
    memory M_I = M_B / 16
    order {
        if i == 0 {
            F(0, 0); F(1, 0); F(2, 1); F(3, 1); BW(2, 1); BW(3, 1)
            R(0, 0); BW(0, 0); R(1, 0); BW(1, 0)
        } else {
            F(2, 1); F(3, 1); F(0, 0); F(1, 0); BW(0, 0); BW(1, 0)
            R(2, 1); BW(2, 1); R(3, 1); BW(3, 1)
        }
    }
    expect peak_memory <= 2 * M_B + 2 * M_I
}
