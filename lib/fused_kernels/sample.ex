defmodule FusedKernels.Sample do
  @moduledoc false
  # Random host tensors as `{binary, shape, type}` triples: the data the ExUnit tests, the
  # backbones' `random_params` and the `mix bench` cases (bench/cases/) feed the ops.

  @doc "A `{binary, shape, type}` of uniform values in [-2, 2) (never zeros)."
  @spec random_triple(tuple, tuple) :: FusedKernels.Tensor.triple()
  def random_triple(shape, type) do
    values = for _ <- 1..Tuple.product(shape), do: :rand.uniform() * 4 - 2
    {encode_values(values, type), shape, type}
  end

  @doc "Encodes floats as a native-endian binary of `type` (bf16 by truncation)."
  @spec encode_values([number], tuple) :: binary
  def encode_values(values, type), do: for(v <- values, into: <<>>, do: encode(v, type))

  defp encode(v, {:f, 32}), do: <<v::float-32-native>>
  defp encode(v, {:f, 64}), do: <<v::float-64-native>>
  defp encode(v, {:f, 16}), do: <<v::float-16-native>>
  # bf16: the top half of the f32 bits (truncation is fine for random test data).
  defp encode(v, {:bf, 16}) do
    <<hi::16, _::16>> = <<v::float-32-big>>
    <<hi::16-native>>
  end

  @doc "Mamba block params, ExPhil's by default: hidden 256, state 16, expand 2, conv 4, dt_rank 16."
  @spec mamba_block_params(
          String.t(),
          pos_integer,
          pos_integer,
          pos_integer,
          pos_integer,
          pos_integer
        ) :: map
  def mamba_block_params(name \\ "mamba_block", h \\ 256, inner \\ 512, n \\ 16, r \\ 16, k \\ 4) do
    t = {:f, 32}

    rnd = fn shape, scale ->
      {encode_values(
         for(_ <- 1..Tuple.product(shape), do: (:rand.uniform() * 2 - 1) * scale),
         t
       ), shape, t}
    end

    %{
      "#{name}_norm" => %{"gamma" => rnd.({h}, 1.0), "beta" => rnd.({h}, 0.1)},
      "#{name}_in_proj" => %{
        "kernel" => rnd.({h, 2 * inner}, 0.1),
        "bias" => rnd.({2 * inner}, 0.1)
      },
      "#{name}_conv_dw_conv" => %{
        "kernel" => rnd.({k, 1, inner}, 0.5),
        "bias" => rnd.({inner}, 0.1)
      },
      "#{name}_ssm_bc_proj" => %{
        "kernel" => rnd.({inner, 2 * n}, 0.1),
        "bias" => rnd.({2 * n}, 0.1)
      },
      "#{name}_ssm_dt_rank" => %{"kernel" => rnd.({inner, r}, 0.1), "bias" => rnd.({r}, 0.1)},
      "#{name}_ssm_dt_proj" => %{
        "kernel" => rnd.({r, inner}, 0.3),
        "bias" => rnd.({inner}, 1.0)
      },
      "#{name}_out_proj" => %{"kernel" => rnd.({inner, h}, 0.1), "bias" => rnd.({h}, 0.1)}
    }
  end
end
