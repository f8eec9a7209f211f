"""eaglenest.ingest"""
