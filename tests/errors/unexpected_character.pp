# expect: tests/errors/unexpected_character.pp:4:17: error: unexpected character '$'
schedule s {
    param d = 4
    param m = 8 $ 2
}
