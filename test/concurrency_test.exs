defmodule FusedKernels.ConcurrencyTest do
  # 32 processes calling at once must get exactly what serial calls get, with no deadlock,
  # and repeated rounds must not grow memory.
  use ExUnit.Case

  alias FusedKernels.{ScaledSoftmax, TestRef}

  @processes 32
  @calls_each 8

  defp inputs do
    for p <- 1..@processes, c <- 1..@calls_each do
      shape = Enum.at([{3, 61}, {1, 4, 60, 60}, {5, 1000}, {2, 1, 7, 9}], rem(p + c, 4))
      type = Enum.at([{:f, 32}, {:bf, 16}, {:f, 16}], rem(p * c, 3))

      {{TestRef.encode(TestRef.random_list(Tuple.product(shape)), type), shape, type},
       rem(p, 2) == 0}
    end
  end

  defp concurrent_equals_serial(backend) do
    inputs = inputs()

    call = fn {x, causal} ->
      ScaledSoftmax.native(x, backend: backend, scale: 0.5, causal: causal)
    end

    serial = Enum.map(inputs, call)

    concurrent =
      inputs
      |> Enum.chunk_every(@calls_each)
      |> Enum.map(fn chunk -> Task.async(fn -> Enum.map(chunk, call) end) end)
      |> Task.await_many(60_000)
      |> Enum.concat()

    assert concurrent == serial
  end

  defp memory_stays_flat(backend) do
    round = fn ->
      concurrent_equals_serial(backend)
      :erlang.garbage_collect()
      {TestRef.rss_bytes(), :erlang.memory(:total)}
    end

    # The first rounds settle allocator pools; later rounds must not keep growing.
    _ = round.()
    {rss1, beam1} = round.()
    for _ <- 1..3, do: round.()
    {rss2, beam2} = round.()
    assert rss2 - rss1 < 64 * 1024 * 1024, "RSS grew by #{rss2 - rss1} bytes"
    assert beam2 - beam1 < 32 * 1024 * 1024, "BEAM memory grew by #{beam2 - beam1} bytes"
  end

  test "cpu: 32 concurrent processes get the serial results, memory stays flat" do
    memory_stays_flat(:cpu)
  end

  @tag :cuda
  test "cuda: 32 concurrent processes get the serial results, memory stays flat" do
    memory_stays_flat(:cuda)
  end
end
