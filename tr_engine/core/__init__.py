"""The algorithm: Token Recycling's step (retrieve, verify, accept, compact, learn, recycle), the decode
driver that runs it for one sequence or many, the drafters, the matrix, trees and their planner, sampling."""
