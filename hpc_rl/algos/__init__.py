"""Pure tensor functions: advantages, policy/value losses, KL estimators and controllers."""
