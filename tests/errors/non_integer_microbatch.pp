# expect: tests/errors/non_integer_microbatch.pp:7:27: error: a microbatch index must be an integer, got 1/2
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        for j in 0..m { F(j / 2) }
    }
}
