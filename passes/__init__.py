"""accelc's graph rewrites, one file each; accelc.pipeline.PASSES runs them in order."""
