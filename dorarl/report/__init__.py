"""What a user looks at: PNG plots and TensorBoard scalars written from run records."""
