"""eaglenest.tinytarget"""
