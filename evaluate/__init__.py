"""eaglenest.evaluate"""
