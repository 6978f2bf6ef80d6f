"""Model families: configs, weight loading, and the forward passes that wire layers together."""
