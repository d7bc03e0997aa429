"""Drawing helpers for the notebooks, kept out of the way of the lesson.

A notebook's figures are part of what it teaches, but the twenty lines of matplotlib that lay out
a figure are not: ``minillm.plots.nbNN`` holds notebook NN's drawing functions, each taking the
data the notebook computed and returning (or showing) the figure; ``minillm.plots.widgets`` shows
a widget and the picture of its first state as one output, for every notebook. A learner who wants
to see how a picture is made opens the module; everyone else reads the lesson. Nothing else in
minillm imports this package, and importing it does not import matplotlib until a function draws.
"""
