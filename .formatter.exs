[inputs: ["{mix,.formatter}.exs", "native/*.exs", "{lib,test,bench}/**/*.{ex,exs}"]]
