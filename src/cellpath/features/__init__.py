"""Foundation-model features at nuclear coordinates: encoders, tiling, readouts and the feature store."""
