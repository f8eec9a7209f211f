"""eaglenest.serve"""
