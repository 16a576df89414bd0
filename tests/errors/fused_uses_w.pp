# expect: tests/errors/fused_uses_w.pp:8:25: error: this schedule's backward is fused: write BW, not B
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { B(j); W(j) }
    }
}
