defmodule FusedKernels.NifFuzzTest do
  # A short run of the seeded fuzz over every NIF (test/support/nif_fuzz.exs): 4 concurrent
  # callers, valid and mutated calls. The seed is printed; replay a failure with
  # `mix run test/fuzz.exs --seed SEED --only CALL` (or `--bisect` to find it after a crash).
  # FK_FUZZ_SEED / FK_FUZZ_CALLS choose the seed and the length.
  use ExUnit.Case

  alias FusedKernels.NifFuzz

  @moduletag timeout: 300_000

  test "every NIF keeps the contract on random valid and mutated calls" do
    seed =
      case System.get_env("FK_FUZZ_SEED") do
        nil -> :rand.uniform(1_000_000_000)
        s -> String.to_integer(s)
      end

    calls = String.to_integer(System.get_env("FK_FUZZ_CALLS") || "4000")
    IO.puts("\nNIF fuzz: seed #{seed}, #{calls} calls (mix run test/fuzz.exs --seed #{seed})")
    r = NifFuzz.run(seed, 0, calls, 4)

    failures =
      for {i, why} <- Enum.take(Enum.sort(r.failures), 5),
          do: "call #{i}: #{why}\n    #{NifFuzz.one_line(seed, i)}"

    assert r.failures == [], "seed #{seed}:\n" <> Enum.join(failures, "\n")
    assert r.calls == calls
    # Valid calls reach every CPU op (the fuzz is not only exercising the decoders).
    for nif <- ~w(scaled_softmax dense dense_prepare dense_prepared flash_attention rnn
                  rnn_prepare rnn_prepared selective_scan norm mamba_block stream_shift_append
                  stream_reshape mamba_block_state engine_load engine_predict engine_init_state
                  engine_step engine_reset engine_state_info engine_graphs)a do
      assert Map.get(r.ok_by_nif, nif, 0) > 0, "no successful #{nif} call in #{calls}"
    end
  end
end
