# expect: tests/errors/negative_m.pp:4:15: error: m (the number of microbatches) must be a positive integer, got 0
schedule s {
    param d = 4
    param m = 4 - d
    order { }
}
