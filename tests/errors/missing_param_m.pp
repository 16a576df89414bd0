# expect: tests/errors/missing_param_m.pp:2:10: error: schedule 's' declares no 'param m' (the number of microbatches)
schedule s {
    param d = 4
    order { }
}
