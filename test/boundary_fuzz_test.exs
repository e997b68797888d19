defmodule FusedKernels.BoundaryFuzzTest do
  # 10,000 random calls across the NIF boundary: valid calls must succeed, and every invalid
  # one must come back as {:error, {kind, message}} naming what was wrong. None may crash the VM.
  use ExUnit.Case, async: true

  import Bitwise
  alias FusedKernels.Native

  @calls 10_000
  @kinds [:argument, :unavailable, :out_of_memory, :compile, :cuda]

  # Each generator returns {term, nil} when valid or {term, word} with the word an error must name.
  defp gen_type do
    pick([
      {{:f, 32}, nil},
      {{:f, 16}, nil},
      {{:bf, 16}, nil},
      {{:f, 64}, nil},
      {{:s, 32}, "type"},
      {{:f, 8}, "type"},
      {{:bf, -1}, "type"},
      {:f32, "type"},
      {{:f, 32, 1}, "type"},
      {"f32", "type"}
    ])
  end

  defp gen_shape do
    valid = Enum.map(1..Enum.random([2, 2, 4]), fn _ -> Enum.random(1..9) end) |> List.to_tuple()

    # {shape, stage, word}: the NIF checks the shape's structure, then the type, then the
    # element count, then the byte size, and the op's own rank rule last.
    pick([
      {valid, nil, nil},
      {valid, nil, nil},
      {valid, nil, nil},
      {put_elem(valid, 0, 0), :count, "dimension"},
      {put_elem(valid, 0, -3), :structure, "negative"},
      {put_elem(valid, 0, 1.5), :structure, "shape"},
      {put_elem(valid, 0, 1 <<< 40), :count, "elements"},
      {{1 <<< 31, 1 <<< 31}, :count, "elements"},
      {Tuple.to_list(valid) ++ [:x], :structure, "shape"},
      {{}, :count, "rank"},
      {{3}, :op, "2-D"},
      {{2, 2, 2}, :op, "2-D"},
      {:shape, :structure, "shape"}
    ])
  end

  defp gen_x do
    {shape, stage, shape_err} = gen_shape()
    {type, type_err} = gen_type()

    size =
      case {shape, type} do
        {s, {k, b}} when is_tuple(s) and k in [:f, :bf] and is_integer(b) and b > 0 ->
          s
          |> Tuple.to_list()
          |> Enum.reduce(1, fn d, acc ->
            if is_integer(d) and d in 0..64, do: d * acc, else: acc
          end)
          |> Kernel.*(div(b, 8))

        _ ->
          16
      end

    bytes = :crypto.strong_rand_bytes(max(size, 0))

    {data, data_err} =
      pick([
        {bytes, nil},
        {bytes, nil},
        {bytes, nil},
        {binary_part(bytes, 0, max(size - Enum.random(1..3), 0)), "bytes"},
        {bytes <> :crypto.strong_rand_bytes(Enum.random(1..5)), "bytes"},
        {:binary.bin_to_list(bytes), "binary"},
        {nil, "binary"}
      ])

    err_at = fn st -> if stage == st, do: shape_err end
    {bytes_err, binary_err} = if data_err == "bytes", do: {data_err, nil}, else: {nil, data_err}
    err = err_at.(:structure) || type_err || binary_err || err_at.(:count) || bytes_err
    # The op's rank rule applies to scaled_softmax only, after the tensor itself is valid.
    op_err = err || err_at.(:op)

    pick([
      {{data, shape, type}, err, op_err},
      {{data, shape, type}, err, op_err},
      {{data, shape, type}, err, op_err},
      {{data, shape}, "expected", "expected"},
      {[data, shape, type], "expected", "expected"},
      {:not_a_tensor, "expected", "expected"},
      {%{data: data}, "expected", "expected"},
      {make_ref(), "expected", "expected"}
    ])
  end

  defp gen_scale,
    do:
      pick([
        {1.0, nil},
        {0.125, nil},
        {3, nil},
        {"1.0", "scale"},
        {:nan, "scale"},
        {1 <<< 70, "scale"}
      ])

  defp gen_causal, do: pick([{true, nil}, {false, nil}, {:yes, "causal"}, {1, "causal"}])

  defp gen_backend,
    do:
      pick([
        {:cpu, nil},
        {:cpu, nil},
        {:cpu, nil},
        {:cuda, nil},
        {:tpu, "backend"},
        {"cpu", "backend"}
      ])

  defp gen_device,
    do:
      pick([
        {nil, nil},
        {nil, nil},
        {0, nil},
        {-1, "device"},
        {1 <<< 40, "device"},
        {:gpu, "device"}
      ])

  defp gen_out, do: pick([{:host, nil}, {:host, nil}, {:device, nil}, {:disk, "out"}])

  # Each component is valid 85% of the time, so about a quarter of all calls are fully valid
  # and the rest exercise every kind of bad input.
  defp pick(list) do
    {valid, invalid} = Enum.split_with(list, &(elem(&1, 1) == nil))

    if invalid == [] or (valid != [] and :rand.uniform() < 0.85),
      do: Enum.random(valid),
      else: Enum.random(invalid)
  end

  test "#{@calls} random scaled_softmax calls never crash and always explain themselves" do
    :rand.seed(:exsss, {1, 2, 3})
    cuda? = FusedKernels.Backend.cuda_available?()

    counts =
      Enum.reduce(1..@calls, %{ok: 0, error: 0}, fn _, counts ->
        {x, _, x_err} = gen_x()
        args = [{x, x_err}, gen_scale(), gen_causal(), gen_backend(), gen_device(), gen_out()]
        terms = Enum.map(args, &elem(&1, 0))
        errors = args |> Enum.map(&elem(&1, 1)) |> Enum.reject(&is_nil/1)
        [x, scale, causal, backend, device, out] = terms

        result =
          Native.scaled_softmax(%{x: x}, %{
            scale: scale,
            causal: causal,
            backend: backend,
            device: device,
            out: out
          })

        case result do
          {:ok, value} ->
            assert errors == [], "accepted invalid call #{inspect(terms, limit: 8)}"
            assert valid_result?(value, out)
            %{counts | ok: counts.ok + 1}

          {:error, {kind, message}}
          when kind in @kinds and is_binary(message) and message != "" ->
            cond do
              errors != [] ->
                assert kind == :argument, "#{inspect(terms, limit: 8)} -> #{inspect(result)}"

                assert Enum.any?(errors, &String.contains?(message, &1)),
                       "message #{inspect(message)} names none of #{inspect(errors)}"

              backend == :cuda and cuda? and match?({_, _, {:f, 64}}, x) ->
                assert message =~ "f64 is CPU-only"

              backend == :cpu and out == :device ->
                assert message =~ "host tensors only"

              backend == :cuda and not cuda? ->
                assert kind == :unavailable

              true ->
                flunk("valid call #{inspect(terms, limit: 8)} failed: #{inspect(result)}")
            end

            %{counts | error: counts.error + 1}

          other ->
            flunk("unexpected result shape: #{inspect(other, limit: 8)}")
        end
      end)

    assert counts.ok > 500 and counts.error > 500, inspect(counts)
  end

  test "buffer NIFs refuse anything that is not a buffer or a valid tensor" do
    for term <- [nil, :x, make_ref(), {<<>>, {1}, {:f, 32}}, self(), "buf", 1.0] do
      assert {:error, {:argument, msg}} = Native.buffer_download(term)
      assert msg =~ "buffer"
      assert {:error, {:argument, _}} = Native.buffer_meta(term)
    end

    for _ <- 1..500 do
      {x, err, _} = gen_x()

      case Native.buffer_upload(x, nil) do
        {:error, {:argument, msg}} ->
          assert err && msg =~ err, "#{inspect(x, limit: 6)}: #{msg} (expected #{inspect(err)})"

        {:error, {:unavailable, _}} ->
          refute FusedKernels.Backend.cuda_available?()

        {:ok, ref} ->
          assert is_reference(ref) and is_nil(err)
      end
    end
  end

  defp valid_result?({bin, shape, {_, bits}}, :host),
    do: is_binary(bin) and byte_size(bin) == Tuple.product(shape) * div(bits, 8)

  defp valid_result?(ref, :device), do: is_reference(ref)
end
