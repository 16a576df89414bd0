# expect: tests/errors/unknown_placement.pp:5:11: error: unknown placement 'paralel'; did you mean 'parallel'?
schedule s {
    param d = 4
    param m = 8
    place paralel
}
