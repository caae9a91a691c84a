"""The kubernetes provider: a Job per sandbox (:mod:`.provider`), the objects it makes, SDK-free
(:mod:`.objects`), and commands run in a sandbox's pod (:mod:`.execution`). Importing this
package loads no SDK: the provider module does, when it is chosen."""
