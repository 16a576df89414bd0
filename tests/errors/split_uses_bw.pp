# expect: tests/errors/split_uses_bw.pp:7:25: error: this schedule's backward is split: write B and W (or `backward fused`)
schedule s {
    param d = 4
    param m = 8
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
}
