"""eaglenest.featurestore"""
