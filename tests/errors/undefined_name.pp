# expect: tests/errors/undefined_name.pp:7:21: error: undefined name 'mm'; did you mean 'm'?
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        for j in 0..mm { F(j) }
        for j in 0..m { BW(j) }
    }
}
