# expect: tests/errors/overlap_not_forward_backward.pp:7:25: error: an overlapped pass is a forward and a backward of this device: F(j, c) & B(k, c2), not B(...) & W(...)
schedule s {
    param d = 2
    param m = 2
    order {
        for j in 0..m { F(j) }
        for j in 0..m { B(j) & W(j) }
    }
}
