"""The Caffe2 backend and Caffe2 checkpoints. Nothing here imports Caffe2 until it is used."""
