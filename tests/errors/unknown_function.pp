# expect: tests/errors/unknown_function.pp:4:15: error: unknown function 'mini'; did you mean 'min'?
schedule s {
    param d = 4
    param m = mini(d, 8)
    order { }
}
