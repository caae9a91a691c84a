"""The daytona provider (:mod:`.provider`) and its log stream (:mod:`.logs`). Importing this
package loads no SDK: the provider module does."""
