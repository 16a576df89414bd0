# expect: tests/errors/unknown_statement.pp:5:5: error: unknown statement 'plase'; did you mean 'place'?
schedule s {
    param d = 4
    param m = 8
    plase parallel
}
