"""eaglenest.train"""
