# expect: tests/errors/bad_exponent.pp:4:19: error: an exponent is a whole number from 0 to 64, got -1
schedule s {
    param d = 2
    param m = 2 ^ -1
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
