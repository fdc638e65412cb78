"""The Batch API's runner in the jobs tier: lines through the fleet, results into files."""
